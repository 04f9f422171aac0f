"""Random add / step / finish / abort / fork / pause sequences never corrupt the block pool, under either
scheduling policy (requests of random priorities)."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.backend.core.request import RequestStatus
from pagedserve.backend.core.request_queue import priority_key

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], [3, 3, 3, 3, 3, 3]]


def make_machine(runner_factory, alone):
    class SchedulerMachine(RuleBasedStateMachine):
        """Drives a FakeRunner over an 11-block pool; the runner itself checks every KV read."""

        @initialize(
            caching=st.booleans(),
            block_size=st.sampled_from([2, 4]),
            budget=st.sampled_from([4, 16, 64]),
            policy=st.sampled_from(["fcfs", "priority"]),
        )
        def setup(self, caching, block_size, budget, policy):
            self.runner = runner_factory(
                num_blocks=11,
                block_size=block_size,
                max_num_batched_tokens=budget,
                max_num_seqs=6,
                max_model_len=11 * block_size,
                enable_prefix_caching=caching,
                scheduling_policy=policy,
            )
            self.sched = self.runner.scheduler
            self.count = 0
            self.expected: dict[str, list[int]] = {}
            self.cut_short: set[str] = set()

        def _ids(self, status=None):
            return sorted(
                r.request_id for r in self.sched.requests.values() if status is None or r.status == status
            )

        @rule(
            prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 49), max_size=10), data=st.data()
        )
        def add(self, prefix, tail, data):
            prompt = prefix + tail
            room = self.sched.config.max_model_len - len(prompt)
            max_tokens = data.draw(st.integers(1, min(room, 12)))
            request_id = f"r{self.count}"
            self.count += 1
            self.runner.add(request_id, prompt, max_tokens, priority=data.draw(st.integers(-1, 2)))
            self.expected[request_id] = alone(prompt, max_tokens)

        @rule()
        def step(self):
            self.runner.step()

        @precondition(lambda self: self.sched.requests)
        @rule(data=st.data(), abort=st.booleans())
        def finish_one(self, data, abort):
            request_id = data.draw(st.sampled_from(self._ids()))
            status = RequestStatus.FINISHED_ABORTED if abort else RequestStatus.FINISHED_STOPPED
            self.sched.finish_requests([request_id], status)
            self.cut_short.add(request_id)

        @precondition(
            lambda self: any(r.status == RequestStatus.RUNNING for r in self.sched.requests.values())
        )
        @rule(data=st.data(), token=st.integers(1, 49))
        def fork(self, data, token):
            parent_id = data.draw(st.sampled_from(self._ids(RequestStatus.RUNNING)))
            parent = self.sched.get_request(parent_id)
            child_id = f"r{self.count}"
            self.count += 1
            child = self.runner.fork(parent_id, child_id, next_tok=token)
            child.max_tokens = max(parent.max_tokens, child.num_output_tokens)
            forced = list(child.output_token_ids)
            self.expected[child_id] = alone(child.prompt_token_ids, child.max_tokens, forced=forced)

        @rule()
        def reset_prefix_cache(self):
            self.sched.reset_prefix_cache()

        @invariant()
        def no_block_is_leaked(self):
            bm = self.sched.block_manager
            used = sum(1 for b in bm.blocks if b.ref_cnt > 0)
            assert bm.num_free_blocks + used == bm.num_blocks
            assert all(b.ref_cnt == 0 for b in bm.free_queue)

        @invariant()
        def ref_counts_equal_the_tables_holding_each_block(self):
            bm = self.sched.block_manager
            holders = Counter(b for table in bm.block_tables.values() for b in table)
            assert all(bm.blocks[i].ref_cnt == holders.get(i, 0) for i in range(bm.num_blocks))
            assert set(bm.block_tables) == {
                r.request_id for r in self.sched.requests.values() if r.status == RequestStatus.RUNNING
            }

        @invariant()
        def running_requests_hold_blocks_for_every_computed_token(self):
            bm = self.sched.block_manager
            for request in self.sched.requests.values():
                if request.status == RequestStatus.RUNNING:
                    table = bm.get_block_table(request.request_id)
                    assert len(table) == -(-request.num_computed_tokens // bm.block_size)
                else:
                    assert request.num_computed_tokens == 0

        @invariant()
        def under_the_priority_policy_running_requests_stay_in_priority_order(self):
            if self.sched.config.scheduling_policy == "priority":
                keys = [priority_key(r) for r in self.sched.running if r.status == RequestStatus.RUNNING]
                assert keys == sorted(keys)

        @invariant()
        def cached_hashes_point_at_their_blocks(self):
            bm = self.sched.block_manager
            assert all(bm._cached[b.block_hash] is b for b in bm.blocks if b.block_hash is not None)
            assert self.sched.num_running + self.sched.num_waiting == len(self.sched.requests)

        def teardown(self):
            if not hasattr(self, "runner"):
                return
            outputs = self.runner.run(max_steps=2000)
            assert self.sched.block_manager.num_free_blocks == self.sched.block_manager.num_blocks
            for request_id, tokens in outputs.items():
                if request_id not in self.cut_short:
                    assert tokens == self.expected[request_id], request_id

    return SchedulerMachine


def test_random_operation_sequences_keep_the_pool_consistent(runner_factory, alone):
    machine = make_machine(runner_factory, alone)
    machine.TestCase.settings = settings(
        max_examples=80,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
