"""PyTorch's RPC example "REINFORCE with observers", as a PyTorch user writes it.

Rank 0 is the agent: it holds the policy, creates one ``Observer`` per other rank with ``rpc.remote``
and starts each episode with ``rpc_async`` on every observer. Each observer steps its own CartPole and
asks the agent for every action (``rpc_sync`` of a method on the agent's RRef), then reports the reward.
After an episode the agent runs REINFORCE's update locally. Processes start with
``torch.multiprocessing.spawn``.

Run it on PyTorch: ``python examples/tutorials/reinforce.py``; unchanged under twinrpc's simulator:
``python -m twinrpc.simulator run --nproc-per-node 1 examples/tutorials/reinforce.py``.

What differs from the example: CartPole comes from :mod:`cartpole` (gymnasium's dynamics in NumPy)
instead of gymnasium, a fixed number of episodes instead of "until solved", fewer steps per episode,
and ``MASTER_PORT`` from the environment when set. With one observer (the default world of 2) every
world prints the same rewards; with more, the order in which observers reach the agent decides which
sample each one gets, as in PyTorch.
"""

import argparse
import os

import cartpole as gym
import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync
from torch.distributions import Categorical

AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"

parser = argparse.ArgumentParser(description="PyTorch RPC RL example")
parser.add_argument("--world-size", type=int, default=2, help="rank 0 is the agent, the others observers")
parser.add_argument("--gamma", type=float, default=0.99)
parser.add_argument("--seed", type=int, default=543)
parser.add_argument("--episodes", type=int, default=4)
parser.add_argument("--steps", type=int, default=40, help="steps of each observer's episode")
args = parser.parse_args()


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc_sync(rref.owner(), _call_method, args=[method, rref, *args], kwargs=kwargs)


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=1)


class Observer:
    """Owns one environment; asks the agent for each action and reports each reward."""

    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = gym.make("CartPole-v1")
        self.env.reset(seed=args.seed + self.id)

    def run_episode(self, agent_rref, n_steps):
        state = self.env.reset()[0]
        for _ in range(n_steps):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward, terminated, truncated, _ = self.env.step(action)
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)
            if terminated or truncated:
                break


class Agent:
    def __init__(self, world_size):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = np.finfo(np.float32).eps.item()
        self.running_reward = 0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        state = torch.from_numpy(state).float().unsqueeze(0)
        m = Categorical(self.policy(state))
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps):
        futs = [
            rpc_async(
                ob_rref.owner(), _call_method, args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps)
            )
            for ob_rref in self.ob_rrefs
        ]
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        R, probs, rewards = 0, [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            rewards.extend(self.rewards[ob_id])
        min_reward = min(sum(self.rewards[ob_id]) for ob_id in self.rewards)
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        returns = []
        for r in rewards[::-1]:
            R = r + args.gamma * R
            returns.insert(0, R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + self.eps)
        policy_loss = torch.cat([-log_prob * R for log_prob, R in zip(probs, returns, strict=True)]).sum()
        self.optimizer.zero_grad()
        policy_loss.backward()
        self.optimizer.step()
        return min_reward


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = os.environ.get("EXAMPLE_PORT", "29500")
    torch.manual_seed(args.seed)
    if rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        agent = Agent(world_size)
        for i_episode in range(1, args.episodes + 1):
            agent.run_episode(n_steps=args.steps)
            last_reward = agent.finish_episode()
            print(
                f"Episode {i_episode}\tLast reward: {last_reward:.2f}\tAverage reward: {agent.running_reward:.2f}"
            )
    else:
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size)
    rpc.shutdown()


def main():
    mp.spawn(run_worker, args=(args.world_size,), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
