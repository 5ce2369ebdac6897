"""The link between nodes (no Django): its protocol, the client a front and a
supervisor open links with, the relay that carries a link's streams to this
host's engines (with who may link, admission.py, and what a link may ask,
gate.py) and model files between nodes (files.py)."""
