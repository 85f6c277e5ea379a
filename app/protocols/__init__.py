"""Wire formats: each module parses one protocol into canonical requests and renders results.
Imported by fronts; an engine process imports only the REST error body (its direct
endpoint's answers) and what the job-end callback uses (``fetch``, ``trust``, ``errors``),
and a remote engine speaks ``pdserving`` and ``pipeline_stubs`` as a client.
"""
