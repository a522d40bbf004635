"""A CartPole-v1 environment in NumPy, with gymnasium's interface, for the reinforcement-learning examples.

PyTorch's RPC RL examples use ``gymnasium.make("CartPole-v1")``; gymnasium is not a dependency of
twinrpc, so the examples import this module as ``gym`` instead. The dynamics, the termination rules
(pole past 12 degrees, cart past 2.4, 500 steps) and the reward are gymnasium's classic-control ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spec:
    id: str
    reward_threshold: float
    max_episode_steps: int


class CartPole:
    """The cart-pole system of Barto, Sutton and Anderson, integrated with explicit Euler steps."""

    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    length = 0.5  # half the pole's length
    force_mag = 10.0
    tau = 0.02
    theta_threshold = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def __init__(self) -> None:
        self.spec = Spec("CartPole-v1", reward_threshold=475.0, max_episode_steps=500)
        self._rng = np.random.default_rng()
        self._state = np.zeros(4)
        self._steps = 0

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._state = self._rng.uniform(-0.05, 0.05, size=4)
        self._steps = 0
        return self._state.astype(np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        x, x_dot, theta, theta_dot = self._state
        force = self.force_mag if action == 1 else -self.force_mag
        total_mass = self.masscart + self.masspole
        polemass_length = self.masspole * self.length
        costheta, sintheta = math.cos(theta), math.sin(theta)
        temp = (force + polemass_length * theta_dot**2 * sintheta) / total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta**2 / total_mass)
        )
        xacc = temp - polemass_length * thetaacc * costheta / total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * xacc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * thetaacc
        self._state = np.array([x, x_dot, theta, theta_dot])
        self._steps += 1
        terminated = bool(
            x < -self.x_threshold
            or x > self.x_threshold
            or theta < -self.theta_threshold
            or theta > self.theta_threshold
        )
        truncated = self._steps >= self.spec.max_episode_steps
        return self._state.astype(np.float32), 1.0, terminated, truncated, {}


def make(name: str) -> CartPole:
    if name != "CartPole-v1":
        raise ValueError(f"only CartPole-v1 is modelled here, not {name!r}")
    return CartPole()
