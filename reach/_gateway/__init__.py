"""The HTTP edge: the gateway, its A2A endpoint and the status page (the ``edge`` extra;
nothing under here is imported by ``import reach``)."""
