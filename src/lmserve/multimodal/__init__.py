"""Images in: decoded, checked images (image_io.py) and each vision family's preprocessing, kept apart from I/O.

A leaf package: it imports nothing of lmserve but the plain modules, so the server (which fetches and decodes what a
client sent), the engine front end (which expands placeholders) and the offline LLM share one definition of an image.
"""
