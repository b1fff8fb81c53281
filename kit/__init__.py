"""Helpers plugin authors may import: tensor and trainer utilities, Hugging Face loading, distributed set-up,
KL estimators, answer extraction and epoch order.

The hook contract itself (hookspecs, types, Protocols, errors) is :mod:`furlong.hooks`; nothing here is
part of it, and the core treats a plugin the same whether it uses these or not.
"""
