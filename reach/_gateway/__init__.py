"""The HTTP edge: the gateway's FastAPI app, its routers (A2A included) and helpers.

Imports FastAPI, the a2a-sdk and httpx (the ``edge`` extra): ``import reach`` never imports
this package; only ``reach gateway`` or a user who asks for it does.
"""
