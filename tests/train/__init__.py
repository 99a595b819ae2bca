"""Tests of meshtrain.train: config, data, tokenizer, loader."""
