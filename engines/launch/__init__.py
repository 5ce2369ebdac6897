"""What an engine is told at spawn and by `configure` (config), and the one place
that starts an engine process (process)."""
