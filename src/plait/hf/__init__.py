"""Hugging Face model directories in and out of plait runs (`plait import`, `plait export`)."""
