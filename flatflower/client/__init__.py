"""The client side: the ClientApp (app.py: one ``TrainCall`` per train message, the same in
every engine), the local training loop (train.py), the batch as rules see it (batch.py), records
<-> the lists rules work on (layout.py), SAM machinery (sam.py), the client state mirror
(state.py), the node settings of ``--node-config`` (node.py), fault injection for tests
(faults.py), and each algorithm's client half in client/algorithms/."""
