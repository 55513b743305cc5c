"""What a node process is made of: the ZMQ service base (control socket, event sender, health
probe), node metrics, the one table of node flags, child-process helpers, and the client the
router and tests use to talk to nodes."""
