"""What the tests share beyond fakes: the seeds' helpers their ported tests call (request
objects added with LazyRegister, membership deltas, the replica apply loop, Dynamo's ZMQ wire
format, a recording publisher) and the one place that reads a tracker's internals."""
