"""Prometheus metrics. The service's state is read at scrape time by custom collectors, so the
hot path updates no metric at all and the series of a removed rank disappear with it:
``tracker`` (the slot tracker and replication), ``selection`` (the selection API and the
router's decisions), ``kv_events`` (the engines' KV events), ``discovery``; ``http`` counts the
HTTP requests (and writes the access log); ``process`` builds the registry with the process's
own series. Label values are bounded in length (``labels``)."""
