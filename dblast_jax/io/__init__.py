"""Checkpoint and file formats: GGUF, Hugging Face, DFlash, safetensors, tokenizers, pinned
files, atomic writes and local / object-store paths."""
