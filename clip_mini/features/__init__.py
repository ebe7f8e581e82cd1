"""Features outside the towers: the numpy normaliser of feature rows, and image files found and embedded in batches.

Shared by the embedding API (``clip_mini.embed``), indexing (``clip_mini.retrieval``) and evaluation
(``clip_mini.eval``), which sit above it; it sits above the model and the data pipeline, which it imports only
inside the functions that need them (``unit`` imports numpy alone: the torch-free search path uses it).

    unit          unit_rows: rows scaled to unit L2 length
    image_files   image files under a folder, and their image features in batches (the indexing loader)
    terms         query arithmetic: weighted text and image terms ("a dog" + "beach" - "grass"), parsed and combined
"""
