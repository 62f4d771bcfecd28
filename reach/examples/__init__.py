"""Example agents, shipped with the package so that a pip install has them too.

The customer-service desk: ``intent`` (``support.ask``, routes a question), ``aftersales``
(refunds, hears ``order.*`` broadcasts) and ``logistics`` (tracking and the durable
``logistics.reroute`` task; run several). ``shopper`` is a client that keeps them busy,
``demo`` runs them all on an embedded nats-server (``reach demo``), and ``http_service``
with ``wrap.toml`` shows ``reach wrap`` putting a plain HTTP service in the fleet.

Run one with ``python -m reach.examples.logistics [AGENT_ID]``; ``reach examples`` lists
them and ``reach examples copy DIR`` copies them out to edit.
"""
