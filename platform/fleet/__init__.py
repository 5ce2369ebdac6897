"""Engine specs, engine state, thermal and concurrency settings, the supervisor."""
