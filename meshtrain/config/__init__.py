"""The torch-free configuration layer: the model's and the parallelism's config dataclasses."""
