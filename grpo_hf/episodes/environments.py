"""Environments (`GRPOTrainer(environment_factory=...)`): stateful objects an episode acts on, with
TRL 1.16's semantics.

- `environment_factory` is a callable that makes an environment, or a dict of them by name; with a
  dict, each row's `environment` column names its environment, and the row's prompt describes only
  that environment's tools (and the shared `tools=`).
- An environment's public methods are its tools (`tools.environment_tools`); two are reserved:
  `reset(**row)` (required) starts an episode and returns None or a string that is appended to the
  prompt's last message (a row without a `prompt` starts from an empty user message, so the string
  is the prompt); `get_reward()` (optional, plain or `async def`) scores the finished episode from
  the environment's state.
- Each instance lives on a thread of its own (`data.calls.CallThread`): it is made there, and its
  reset, its tools and get_reward run there, one call at a time. TRL runs them all on the caller's
  thread; one thread per instance keeps what matters of that (an environment may hold an object
  bound to the thread that made it, such as a `sqlite3` connection) while episodes run concurrently
  and a call can be given up on.
- reset and get_reward run with a time limit, `environment_timeout` (ours; TRL has none): past it
  the call is abandoned and a `TimeoutError` names the method and the setting. A stuck reset stops
  the run; a stuck get_reward is a failing reward function (`reward_error_policy`: the run stops,
  or under 'zero' the episode scores 0), and its instance leaves the pool. A call on an instance
  waits for the calls before it (an abandoned tool call still running, say) within its own limit.
- Construct once, reset often: one instance per name is made at construction (to check it and read
  its tools) and pooled; a batch draws one instance per row, and the pool grows only when a batch
  needs more instances of an environment than exist. Every row's instance is reset before its
  episode. An instance whose tool call or get_reward timed out is dropped from the pool (its
  abandoned call may still be running on it) and a fresh one takes its place when needed.
- Environment-owned rewards: each environment class with `get_reward` adds one reward source
  named after the class, weight 1, after the `reward_funcs` (whose `reward_weights` apply to them
  alone); it scores the rollouts of that exact class and gives None ("does not apply") to others.
- Environment-owned data: with no `train_dataset`, a single environment's `reset()` supplies every
  prompt; the trainer cycles a placeholder dataset of empty prompts, `max_steps` sets the length.
"""

import asyncio
import inspect
from collections.abc import Callable

from datasets import Dataset

from grpo_hf.config.grpo_config import GRPOConfig
from grpo_hf.data.calls import CallThread, CallTimeout

EMPTY_PROMPT = [{"role": "user", "content": ""}]

EnvironmentFactory = Callable[[], object]


class EnvironmentPool:
    """The run's environments by name (None for a single factory) and their reusable instances;
    `timeout` bounds each reset and get_reward (`environment_timeout`)."""

    def __init__(
        self, environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory], timeout: float
    ):
        self.timeout = timeout
        self.multi = isinstance(environment_factory, dict)
        self.factories = dict(environment_factory) if self.multi else {None: environment_factory}
        if not self.factories:
            raise ValueError("environment_factory is an empty dict; map at least one name to a factory.")
        self.probes: dict[str | None, object] = {}  # one instance per name: its tools, its reward
        self._pool: dict[str | None, list[object]] = {}
        self._threads: dict[int, CallThread] = {}  # each instance's own thread, by id()
        self._retired: list[object] = []  # discarded instances, their threads kept for this batch
        for name, factory in self.factories.items():
            label = self._label(name)
            if not callable(factory):
                raise ValueError(
                    f"{label} is {factory!r}; pass a class or a function that returns an environment."
                )
            instance = self._make(name)
            if not inspect.isfunction(getattr(type(instance), "reset", None)):
                raise ValueError(
                    f"{label} made a {type(instance).__name__}, which has no reset method; every environment "
                    "needs `def reset(self, **kwargs)` (called with the row before each episode; it returns None "
                    "or the text to append to the prompt)."
                )
            self.probes[name] = instance
            self._pool[name] = [instance]

    def _label(self, name: str | None) -> str:
        return "environment_factory" + (f"[{name!r}]" if self.multi else "")

    def _make(self, name: str | None) -> object:
        """A new instance of environment `name`, made on the thread that will run all its calls."""
        thread = CallThread(f"grpo-hf {self._label(name)}")
        instance = thread.call(self.factories[name], None, f"{self._label(name)}()")
        self._threads[id(instance)] = thread
        return instance

    def thread(self, environment: object) -> CallThread:
        """The thread that runs `environment`'s calls (an instance of this pool, or one discarded
        during the current batch)."""
        return self._threads[id(environment)]

    def call(self, environment: object, method: str, **kwargs) -> object:
        """`environment.<method>(**kwargs)` on its thread, run to its end when it is `async def`,
        within `environment_timeout`; past it, a `CallTimeout` (a TimeoutError) naming the method and
        the setting (the call is abandoned: it may still run on the environment)."""

        def call() -> object:
            result = getattr(environment, method)(**kwargs)
            return asyncio.run(result) if inspect.iscoroutine(result) else result

        try:
            return self.thread(environment).call(
                call, self.timeout, f"{type(environment).__name__}.{method}()"
            )
        except CallTimeout as err:
            raise CallTimeout(
                f"{err} (environment_timeout={self.timeout:g}): fix the environment, or raise environment_timeout "
                f"if its {method} needs longer."
            ) from None

    def start_episodes(self, rows: list[dict]) -> tuple[list[object], list[str | None], list[list[dict]]]:
        """One reset instance per row: the instances, their names, and the rows' prompts (with what
        `reset` returned appended). The previous batch's discarded instances let go of their threads."""
        for gone in self._retired:
            del self._threads[id(gone)]
        self._retired = []
        names = [row.get("environment") for row in rows] if self.multi else [None] * len(rows)
        unknown = set(names) - self.factories.keys()
        if unknown:
            raise ValueError(
                f"Example has `environment={sorted(unknown, key=str)[0]!r}`, which is not among the environments "
                f"passed to `environment_factory`. Expected one of: {list(self.factories)}."
            )
        drawn: dict[str | None, int] = {}
        instances = []
        for name in names:
            pool, index = self._pool[name], drawn.get(name, 0)
            if index == len(pool):
                pool.append(self._make(name))
            drawn[name] = index + 1
            instances.append(pool[index])
        prompts = [self._reset_prompt(instance, row) for instance, row in zip(instances, rows, strict=True)]
        return instances, names, prompts

    def _reset_prompt(self, environment: object, row: dict) -> list[dict]:
        """Reset `environment` with the row (less its `environment` routing column) and return the
        prompt, what `reset` returned appended to its last message."""
        kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else row
        observation = self.call(environment, "reset", **kwargs)
        prompt = row.get("prompt", EMPTY_PROMPT)
        if observation is None:
            return prompt
        if not isinstance(observation, str):
            raise TypeError(
                f"{type(environment).__name__}.reset returned {type(observation).__name__}; return None or a str "
                "(appended to the prompt's last message)."
            )
        return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]

    def discard(self, instances: list[object]) -> None:
        """Take these instances out of the pool (a fresh one is made when a batch needs it)."""
        for pool in self._pool.values():
            self._retired += [kept for kept in pool if any(kept is gone for gone in instances)]
            pool[:] = [kept for kept in pool if all(kept is not gone for gone in instances)]

    def discard_timed_out(self, instances: list[object], episodes: list) -> None:
        """Discard the instances whose episode (`multi_turn`) had a tool call time out: it may still run."""
        self.discard([kept for kept, episode in zip(instances, episodes, strict=True) if episode.timed_out])

    def reward_functions(self) -> list[Callable]:
        """One reward function per environment class that has `get_reward`, named after the class."""
        classes = dict.fromkeys(
            type(p) for p in self.probes.values() if inspect.isfunction(getattr(type(p), "get_reward", None))
        )
        return [environment_reward(cls, self) for cls in classes]

    def check_dataset(self, dataset, name: str) -> None:
        """A dict of environments needs an `environment` column naming known environments."""
        if not self.multi:
            return
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "environment" not in columns:
            raise ValueError(
                f"{name} has no 'environment' column; a dict environment_factory picks each row's environment "
                f"by it (one of {list(self.factories)})."
            )
        if isinstance(dataset, Dataset):
            unknown = set(dataset["environment"]) - self.factories.keys()
            if unknown:
                raise ValueError(
                    f"{name}: 'environment' values {sorted(unknown, key=str)} are not among the environments passed "
                    f"to `environment_factory`. Expected one of: {list(self.factories)}."
                )


def environment_pool(
    environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None, args: GRPOConfig
) -> EnvironmentPool | None:
    """The run's environments (`environment_timeout` bounding their calls), None without a factory."""
    if environment_factory is None:
        return None
    return EnvironmentPool(environment_factory, args.environment_timeout)


def environment_reward(cls: type, pool: EnvironmentPool) -> Callable:
    """A reward function calling `get_reward()` (`EnvironmentPool.call`: on the instance's thread,
    within environment_timeout) on each rollout's environment of exactly class `cls` (None for other
    classes), `async def` when `get_reward` is (it then awaits each call on a helper thread); named
    after the class. An instance whose get_reward timed out leaves the pool before the error
    propagates."""

    def score(environment: object) -> float | None:
        if type(environment) is not cls:
            return None
        try:
            return pool.call(environment, "get_reward")
        except CallTimeout:  # its call may still run on it
            pool.discard([environment])
            raise

    if inspect.iscoroutinefunction(cls.get_reward):

        async def reward(environments: list, **kwargs) -> list[float | None]:
            return [await asyncio.to_thread(score, e) for e in environments]

    else:

        def reward(environments: list, **kwargs) -> list[float | None]:
            return [score(e) for e in environments]

    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


def train_dataset_or_placeholder(train_dataset, pool: EnvironmentPool | None, args: GRPOConfig):
    """The train dataset, or, when the environment owns the data, a placeholder of empty prompts
    (one generation batch of them, cycled for `max_steps`). Fails when there is no data source."""
    if train_dataset is not None:
        return train_dataset
    if pool is None:
        raise ValueError(
            "`train_dataset` is required unless an `environment_factory` is provided whose reset() returns the "
            "prompt; pass train_dataset=."
        )
    if pool.multi:
        raise ValueError(
            "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
            "`environment` column naming each row's environment; pass one, or a single environment factory."
        )
    if args.max_steps <= 0:
        raise ValueError(
            "Without a `train_dataset` (the environment owns the data: reset() returns the prompt), set max_steps "
            "to a positive number of steps; nothing else gives the run a length."
        )
    return Dataset.from_dict(
        {"prompt": [EMPTY_PROMPT] * (args.generation_batch_size // args.num_generations)}
    )


def check_reward_source(reward_funcs: list) -> None:
    """At least one reward: a reward function, a reward model, or an environment's `get_reward`."""
    if not reward_funcs:
        raise ValueError(
            "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment defines "
            "a `get_reward` method."
        )
