"""What crosses a process boundary between engines and their callers: framing,
error codes, bounds, typed requests and frames, and the clients (local and
through a node link). The web side imports only this package (and launch)."""
