"""One module per front end (a kind of torch tensor the ops run on), each the only place
that touches its library; :mod:`torch_pallas.bridge` chooses one by the tensor's device."""
