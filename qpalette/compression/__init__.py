"""Compress: a plan or scheme → a qpalette checkpoint, streamed block by block, resumable."""
