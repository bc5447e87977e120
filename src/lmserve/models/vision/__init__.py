"""Vision towers and projectors: pure torch modules that turn preprocessed pixel values into text-model embeddings.

Each family's file exposes `encode_images(...) -> list of [n_tokens, text_hidden]`, one tensor per image, in the order
of the image placeholders; the engine places them and knows nothing else of the tower. No engine knowledge here.
"""
