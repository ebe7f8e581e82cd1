"""``clip-mini serve``: a search service and web page over an index (``pip install 'clip-mini[serve]'``).

    generations  the index being served, swapped whole when a writer publishes a new generation
    pictures     thumbnails, originals, uploaded query images, attention and match-map overlays
    limits       the request-body cap
    app          the FastAPI app: routes, errors as JSON, the page in ``static/``
    server       the command: checks, prints the URL, runs uvicorn
"""
