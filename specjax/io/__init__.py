"""Reading and writing models: Orbax checkpoints, Hugging Face directories, GGUF files, tokenizers
and chat templates."""

from specjax.io.gguf import convert_gguf, find_packaged_gguf, from_gguf
from specjax.io.hf import convert_hf, from_hf
from specjax.io.orbax import load, restore_tree, save, save_tree
from specjax.io.tokenizer import Tokenizer, load_tokenizer

__all__ = ["convert_gguf", "convert_hf", "find_packaged_gguf", "from_gguf", "from_hf", "load",
           "restore_tree", "save", "save_tree", "Tokenizer", "load_tokenizer"]
