"""The adversarial suite: one test per finding of the trust review (issue 13), each written as the
exploit first, and probes run from **inside** sandboxes.

A probe is a test marked ``@pytest.mark.probe("what it tried")``: it attacks from a sandbox (another
tenant's sandbox, the node's addresses and loopback spellings, the node's sockets, DNS exfiltration,
setuid, ``/proc`` and mounts, disk, fork and memory bombs, floods) and asserts it reached nothing.
``scripts/security_probes.py`` lists them for the README's security section.

Every address a probe targets is on this machine: SPACE's own services on loopback, sandboxes, or
test hosts in network namespaces the test creates. A stand-in for a forbidden host (metadata, a
private range) gets its address on a dummy link inside such a namespace, and the gateway's decision
is asserted, so that even a broken block never sends a packet off the machine.
"""
