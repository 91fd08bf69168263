"""The runtime around the engine: the front (job queue, one worker per replica, cancel), the messages it sends
about jobs, the model-free request checks run before queueing, the resident worker groups (one process per rank)
a replica can be, and the tensor channel between workers."""
