"""Errors raised by the shared-memory transport, so callers can catch them by kind."""


class TransportError(RuntimeError):
    """Base of the errors below."""


class SegmentError(TransportError):
    """A segment that cannot be created or attached (in use, wrong layout, wrong owner)."""


class PeerGoneError(TransportError):
    """The process on the other side of a ring exited or closed it."""


class RingFullError(TransportError):
    """The producer waited its whole timeout and the consumer released no space."""
