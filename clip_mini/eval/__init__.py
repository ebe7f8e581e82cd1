"""Evaluation: retrieval metrics (``metrics``), validation during training (``validation``) and scoring a saved
model (``scoring``)."""
