"""fastllama: one file per concern, imported as fastllama.model, fastllama.generate, ... (the package keeps
generic names such as `model` and `tokenizer` off the path of every program in the environment).

    from fastllama.generate import generate, get_tokenizer, load_model
"""
