"""Weight files in and out: a model's weights read from disk, checked, and written back.

- ``pretrained.py``: ``from_pretrained(source)``, a real model and its tokenizer from SmolLM2's
  package, a ``.gguf`` file, a Hugging Face directory or an attnlab checkpoint;
- ``gguf.py``: llama.cpp's GGUF files -> :class:`attnlab.Llama` + tokenizer;
- ``hf_gpt2.py``, ``hf_llama.py``: Hugging Face ``config.json`` files checked and translated, and
  a :class:`attnlab.TinyGPT` given back to transformers as a ``GPT2LMHeadModel``;
- ``saved_model.py``: ``save_checkpoint`` / ``load_checkpoint``, attnlab's own directory format;
- ``tokenizer.py``: the tokenizers small enough to live in a checkpoint's ``config.json``;
- ``precision.py``: the dtype a model's weights are loaded in, and why;
- ``file_checks.py``: every file checked before a tensor is built from it.

The room sits above :mod:`attnlab.models`, whose architectures it builds; what maps a file's
tensor names onto a model's parameters is a pure function kept with the models
(:mod:`attnlab.models.weight_maps`), so that a model never imports this room.
"""
