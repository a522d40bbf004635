"""PyTorch's RPC example "batch-processing REINFORCE" (``@rpc.functions.async_execution``), as written for PyTorch.

The agent answers every observer's ``select_action`` with a future: the call is parked until the
states of all observers have arrived, then one batched forward pass samples every action and the
parked calls complete. Each answer is ``future_actions.then(...)``: the future ``then`` returns is what
the ``async_execution`` function hands back. Processes start with ``torch.multiprocessing.spawn``,
once per world size from 2 to ``--max-world-size``.

Run it on PyTorch: ``python examples/tutorials/batch_reinforce.py``; unchanged under twinrpc's
simulator: ``python -m twinrpc.simulator run --nproc-per-node 1 examples/tutorials/batch_reinforce.py``.

What differs from the example: CartPole from :mod:`cartpole` instead of gymnasium, the CPU instead of
CUDA (``.cuda()``'s copy of the batched states becomes ``.clone()``), fewer steps and episodes,
``MASTER_PORT`` from the environment when set. With batching, sampling happens once all observers'
states are in, so every world prints the same rewards; without it, with two observers or more, the
order in which they reach the agent decides their samples, as in PyTorch.
"""

import argparse
import os
import threading

import cartpole as gym
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote
from torch.distributions import Categorical

NUM_STEPS = 30
AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"

parser = argparse.ArgumentParser(description="PyTorch RPC Batch RL example")
parser.add_argument("--gamma", type=float, default=1.0)
parser.add_argument("--seed", type=int, default=543)
parser.add_argument("--num-episode", type=int, default=3)
parser.add_argument("--max-world-size", type=int, default=3)
args = parser.parse_args()


class Policy(nn.Module):
    def __init__(self, batch=True):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.dim = 2 if batch else 1

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=self.dim)


class Observer:
    def __init__(self, batch=True):
        self.id = rpc.get_worker_info().id - 1
        self.env = gym.make("CartPole-v1")
        self.env.reset(seed=args.seed + self.id)
        self.select_action = Agent.select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref, n_steps):
        state, _ = self.env.reset()
        ep_reward = NUM_STEPS
        rewards = torch.zeros(n_steps)
        start_step = 0
        for step in range(n_steps):
            state = torch.from_numpy(state).float().unsqueeze(0)
            action = rpc.rpc_sync(agent_rref.owner(), self.select_action, args=(agent_rref, self.id, state))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards[step] = reward
            if terminated or truncated or step + 1 >= n_steps:
                curr_rewards = rewards[start_step : (step + 1)]
                R = 0
                for i in range(curr_rewards.numel() - 1, -1, -1):
                    R = curr_rewards[i] + args.gamma * R
                    curr_rewards[i] = R
                state, _ = self.env.reset()
                if start_step == 0:
                    ep_reward = min(ep_reward, step - start_step + 1)
                start_step = step + 1
        return [rewards, ep_reward]


class Agent:
    def __init__(self, world_size, batch=True):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.policy = Policy(batch)
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.running_reward = 0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer, args=(batch,)))
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.batch = batch
        self.saved_log_probs = [] if batch else {k: [] for k in range(len(self.ob_rrefs))}
        self.future_actions = torch.futures.Future()
        self.lock = threading.Lock()
        self.pending_states = len(self.ob_rrefs)

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, ob_id, state):
        """Park the call until every observer's state is in; one forward pass answers them all."""
        self = agent_rref.local_value()
        self.states[ob_id].copy_(state)
        future_action = self.future_actions.then(lambda future_actions: future_actions.wait()[ob_id].item())
        with self.lock:
            self.pending_states -= 1
            if self.pending_states == 0:
                self.pending_states = len(self.ob_rrefs)
                m = Categorical(self.policy(self.states.clone()))  # the example's .cuda() copy
                actions = m.sample()
                self.saved_log_probs.append(m.log_prob(actions).t()[0])
                future_actions = self.future_actions
                self.future_actions = torch.futures.Future()
                future_actions.set_result(actions)
        return future_action

    @staticmethod
    def select_action(agent_rref, ob_id, state):
        self = agent_rref.local_value()
        m = Categorical(self.policy(state))
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def run_episode(self, n_steps=0):
        futs = [ob_rref.rpc_async().run_episode(self.agent_rref, n_steps) for ob_rref in self.ob_rrefs]
        rets = torch.futures.wait_all(futs)
        rewards = torch.stack([ret[0] for ret in rets]).t()
        ep_rewards = sum(ret[1] for ret in rets) / len(rets)
        if self.batch:
            probs = torch.stack(self.saved_log_probs)
        else:
            probs = torch.stack([torch.stack(self.saved_log_probs[i]) for i in range(len(rets))])
        policy_loss = -probs * rewards / len(rets)
        policy_loss.sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.saved_log_probs = [] if self.batch else {k: [] for k in range(len(self.ob_rrefs))}
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.running_reward = 0.5 * ep_rewards + 0.5 * self.running_reward
        return ep_rewards, self.running_reward


def run_worker(rank, world_size, n_episode, batch):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = os.environ.get("EXAMPLE_PORT", "29500")
    torch.manual_seed(args.seed)
    if rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        agent = Agent(world_size, batch)
        for i_episode in range(n_episode):
            last_reward, running_reward = agent.run_episode(n_steps=NUM_STEPS)
            print(
                f"world {world_size} batch {batch} episode {i_episode}: "
                f"last reward {last_reward:.2f}, running reward {running_reward:.2f}"
            )
    else:
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size)
    rpc.shutdown()


def main():
    for world_size in range(2, args.max_world_size + 1):
        for batch in [True, False]:
            mp.spawn(run_worker, args=(world_size, args.num_episode, batch), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
