"""Built-in models: trained deltas shipped with the package over towers from PyPI packages.

``registry``: names (``list_models``), resolving a name or a model directory (``resolve_model``), building a built-in
once into the user cache (``materialize``) and writing a package (``write_package``); ``delta``: the delta format.
"""
