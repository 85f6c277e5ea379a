"""Wire formats: each module parses one protocol into canonical requests and renders results."""
