"""Engine processes: protocol, server, client, backends, batching. No Django.

Keep this file free of imports: the web process imports engines.client and
engines.protocol, and must never pull an ML library in through the package.
"""
