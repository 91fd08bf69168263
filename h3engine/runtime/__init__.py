"""The runtime around the engine: the front (one resolve, the job queue, one worker per replica, cancel, chained
windows), the messages it sends about jobs, the resident worker groups and split stage groups a replica can be, Ray
Serve replicas, and the tensor channel between workers."""
