"""The web playground: a page served at / (plain HTML/CSS/JS under static/), and its saved shares.

routes.py has the page and share routes, store.py the SQLite file behind the permalinks.
"""
