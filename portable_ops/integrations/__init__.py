"""portable_ops inside other libraries' models.

Each integration is a submodule that imports its library only when imported itself, so neither
``import portable_ops`` nor ``import portable_ops.integrations`` imports any of them:

* :mod:`portable_ops.integrations.transformers`: Hugging Face transformers (>= 5.0),
  ``attn_implementation=register()`` (``docs/integrations.md``).
"""
