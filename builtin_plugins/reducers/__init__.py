"""Built-in ``loss_reducer`` plugins (``--loss-reducer NAME``)."""
