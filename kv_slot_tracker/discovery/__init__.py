"""Worker discovery: sources that tell the service which workers exist, so that nothing has to
call ``/register`` or ``/unregister`` for them. Off by default (the reference has none).

* ``endpoints.py``: pure: an EndpointSlice (as the Kubernetes API sends it) read into workers,
  checked as input, and the discovered set kept per slice, bounded;
* ``apply.py``: the discovered set applied to the service through its topology commands
  (``upsert``, ``unregister``, ``heartbeat``), so that every change is replicated like a call's;
* ``kubernetes.py``: the list and watch of ``discovery.k8s.io/v1`` EndpointSlices with
  ``kubernetes_asyncio`` (the ``[kubernetes]`` extra, imported only when configured).
"""
