"""Adapters that bring the inference engines' KV events in.

Shaped like ``kv_slot_tracker.replication.redis``: a port (``port.py``: what the ingest needs of the
selection service and the counters it keeps), decoded records validated before they reach the
core (``records.py``: the vLLM/SGLang ZMQ wire format), and the transport with its connection
policy (``listener.py``: one worker rank's SUB socket, gap replay over the engine's ROUTER
socket; ``zmq.py``: one listener per schedulable worker rank). The service applies a decoded
batch in one synchronous call, a large one in slices (``slices.py``); nothing here knows the
index's insides. ``peers.py`` hands the index from one instance to another (Dynamo's
``--indexer-peers``): it serves this instance's index with each rank's sequence watermark, and at
start loads another's and seeds the listeners with those watermarks.
"""
