"""Model backends run inside an engine process (they import the ML libraries)."""
