"""The scheduler: a pure, synchronous batching policy (`policy.Scheduler`) and its simulator.

Importing the package stays cheap (standard library only): the process entry point and the
gRPC wrapper import what they need from the submodules.
"""
