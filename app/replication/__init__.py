"""Moving replica events between tracker instances: queues, the apply loop, transports."""
