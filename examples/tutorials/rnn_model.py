"""The distributed RNN model of PyTorch's "RNN with remote embeddings" RPC example.

The embedding table and the decoder live on a parameter server behind RRefs; the LSTM stays with the
trainer. Each forward pass makes two RPCs, and distributed autograd carries gradients back to both
remote modules.
"""

import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef


def _call_method(method, rref, *args, **kwargs):
    """Run ``method`` on the object an RRef owned here refers to."""
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    """Run ``method`` on the RRef's owner and wait for its result."""
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref, *args], kwargs=kwargs)


def _parameter_rrefs(module):
    """One RRef per parameter of a module held on this worker."""
    return [RRef(p) for p in module.parameters()]


class EmbeddingTable(nn.Module):
    """The encoding layer, held by the parameter server."""

    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)

    def forward(self, input):
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    """The decoding layer, held by the parameter server."""

    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, output):
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    """Embedding and decoder on ``ps``, an LSTM here."""

    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        # Not in PyTorch's example: wait until the table exists. Both constructions draw from the
        # parameter server's random generator, and two requests may run at once (on TensorPipe too),
        # so without this wait their initial weights depend on which request draws first.
        _remote_method(nn.Module.train, self.emb_table_rref)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params
