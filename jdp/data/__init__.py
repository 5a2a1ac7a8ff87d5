"""Datasets and global batches."""
