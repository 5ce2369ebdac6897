"""What crosses a process boundary between engines and their callers: framing,
error codes, bounds, typed requests and replies, and the clients (the node
link's, platform/node_link/, speaks through them). The web side imports only
this package (and launch)."""
