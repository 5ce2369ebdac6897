"""A one-shot tool for tests/platform/catalog/test_tool_processes.py: reads its
request like the engines' tools and answers with its environment's names."""

import json
import os
import sys

if __name__ == "__main__":
    json.loads(sys.stdin.read())
    names = sorted(os.environ)
    print(json.dumps({"names": names, "path": os.environ.get("PATH", "")}))
