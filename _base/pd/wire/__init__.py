"""What every process shares and sends, torch-free: wire messages, sampling parameters, the
P/D geometry handshake, and CURVE security for the ZMQ sockets."""
