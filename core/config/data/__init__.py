"""Flag tables as data: Megatron-LM's parser, Miles' argument groups and SGLang's server arguments (see ``furlong.core.config.tables``)."""
