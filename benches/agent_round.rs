//! Loop overhead per round: script backend, instant tools, 3 calls per round.
//! Target: well under 1 ms per round excluding tool work.
//!
//! Run: `cargo bench --bench agent_round`

use std::sync::Arc;

use async_trait::async_trait;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hilum::agent::{
    Agent, AgentConfig, Environment, RunInput, Tool, ToolContext, ToolError, ToolOutput, ToolSpec,
    Toolbox,
};
use hilum::llm::script::{ScriptCall, ScriptTurn};
use hilum::llm::ScriptLlm;
use serde_json::{json, Value};

struct Instant {
    spec: ToolSpec,
}

#[async_trait]
impl Tool for Instant {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    async fn call(&self, _ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::new("ok", json!({"echo": args})))
    }
}

const ROUNDS: usize = 10;

fn turns() -> Vec<ScriptTurn> {
    let mut turns: Vec<ScriptTurn> = (0..ROUNDS)
        .map(|r| ScriptTurn {
            content: format!("Round {r}: checking three things."),
            tool_calls: (0..3)
                .map(|i| ScriptCall {
                    id: Some(format!("c{r}_{i}")),
                    name: format!("t{i}"),
                    arguments: json!({"image": "$IMAGE", "k": i}),
                })
                .collect(),
            error: None,
        })
        .collect();
    turns.push(ScriptTurn {
        content: "Final answer.".into(),
        tool_calls: vec![],
        error: None,
    });
    turns
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut tb = Toolbox::new();
    for i in 0..3 {
        tb.register(Arc::new(Instant {
            spec: ToolSpec {
                name: format!("t{i}"),
                description: "instant".into(),
                parameters: json!({"type": "object", "properties": {
                    "image": {"type": "string", "pattern": "^img_"}, "k": {"type": "integer"}},
                    "required": ["image"]}),
            },
        }))
        .expect("schema");
    }
    let tb = Arc::new(tb);
    let turns = turns();
    let config = AgentConfig {
        max_rounds: ROUNDS + 1,
        max_tool_calls: 1000,
        ..Default::default()
    };
    let mut group = c.benchmark_group("agent");
    group.throughput(Throughput::Elements(ROUNDS as u64));
    group.bench_function("run_10_rounds_3_instant_calls", |b| {
        b.to_async(&rt).iter(|| {
            let agent = Agent::new(
                Arc::new(ScriptLlm::new(turns.clone())),
                tb.clone(),
                Environment::default(),
                config.clone(),
            );
            async move {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                let out = agent
                    .run(
                        RunInput {
                            question: "q".into(),
                            images: vec!["img_0123456789ab".into()],
                            ..Default::default()
                        },
                        Some(tx),
                    )
                    .await;
                assert_eq!(out.rounds, ROUNDS);
                let mut n = 0;
                while rx.try_recv().is_ok() {
                    n += 1;
                }
                n
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
