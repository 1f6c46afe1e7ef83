//! The pipeline that takes one generation of a live lesson to READY or FAILED, the same for
//! every backend (PROTOCOL.md [R1]–[R8]), and [`Steps`], what a backend does at each point.
//!
//! ```text
//! Create:  BOOTING ── create ──┐
//! Change,                      ├─ addresses ─ CONFIGURING ─ prepare ─ configure each endpoint ─
//! Adopt:   locate ─ (gone?) ───┘                            (tries, timeouts)    finish
//!          BOOTING ─ create
//!      ─ probe every presentation (one probe timeout) ─ ready delay ─ ready ─ READY
//! ```
//!
//! Any step's error, a configuration that fails every try, a presentation that does not answer
//! within the probe timeout: FAILED with a reason naming what failed. The future is dropped
//! when a newer generation arrives or the live lesson is deprovisioned, so every step must be
//! safe to repeat.

use std::collections::HashMap;
use std::time::Duration;

use antidote_proto::agent::v1 as proto;
use proto::Phase;

use crate::book::Reporter;
use crate::error::Error;
use crate::lesson::{Endpoint, Lesson};
use crate::output::{Run, Tail};
use crate::probe;

/// The bounds the pipeline applies, which each backend takes from its operator's flags.
#[derive(Debug, Clone)]
pub struct Limits {
    /// How long every presentation may take to answer its probe, from when the endpoints run
    /// ([R2]).
    pub probe_timeout: Duration,
    /// Tries of a stage's configuration of one endpoint before the generation FAILs ([R3]: 3).
    pub configuration_tries: u32,
    /// The operator's ceiling on one configuration try; a lesson may ask for less ([R3]).
    pub configuration_timeout: Duration,
    /// The pause between two tries of a configuration.
    pub retry_pause: Duration,
    /// Waited after the lesson's own ready delay ([R4]).
    pub extra_ready_delay: Duration,
    /// Whether the endpoints' configurations run all at once (each on a machine of its own)
    /// rather than one after another in lesson order.
    pub configure_at_once: bool,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            probe_timeout: Duration::from_secs(60),
            configuration_tries: 3,
            configuration_timeout: Duration::from_secs(300),
            retry_pause: Duration::from_millis(500),
            extra_ready_delay: Duration::ZERO,
            configure_at_once: false,
        }
    }
}

/// Where one endpoint is reached once it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The endpoint's address inside the backend's network, empty when there is none ([R6]).
    pub internal_address: String,
    /// Where each presentation answers, by presentation name.
    pub presentations: HashMap<String, Reach>,
}

/// Where a presentation answers: probed there, reported there ([R6]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reach {
    /// `host:port`, where probes, the entrypoint and operators connect.
    pub address: String,
    /// For HTTP, the URL it answers at; `http://ADDRESS/` when none is given.
    pub url: Option<String>,
}

impl Placement {
    /// An endpoint at `internal_address` whose presentations are not placed yet.
    pub fn new(internal_address: impl Into<String>) -> Placement {
        Placement {
            internal_address: internal_address.into(),
            presentations: HashMap::new(),
        }
    }

    /// Places presentation `name` at `address`.
    pub fn reach(mut self, name: impl Into<String>, address: impl Into<String>) -> Placement {
        self.presentations.insert(
            name.into(),
            Reach {
                address: address.into(),
                url: None,
            },
        );
        self
    }
}

/// How one try of a configuration went.
#[derive(Debug)]
pub enum Attempt {
    /// It ran and ended so, printing this: exit code 0 is done, anything else a failed try,
    /// tried again up to [`Limits::configuration_tries`].
    Ran(Run, Tail),
    /// The backend tried by itself (a Kubernetes Job's `backoffLimit`) and this is its verdict
    /// over every try: not tried again; an error is the FAILED reason as it stands.
    Settled(Result<(), String>),
}

/// How a driver starts a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Nothing exists: create every object (finding what a crashed attempt left), configure.
    Create,
    /// The objects exist and are held: apply the new generation (usually a stage change).
    Change,
    /// The objects exist from before this process started: find them, configure, probe.
    Adopt,
}

/// What a backend does at each point of the pipeline. [`Backend`](crate::Backend) builds on it.
#[tonic::async_trait]
pub trait Steps: Send + Sync + 'static {
    /// What [`Steps::create`] and [`Steps::locate`] hand to the later steps (names, objects
    /// made, what a configuration needs).
    type Objects: Send + Sync;

    /// The bounds the pipeline applies.
    fn limits(&self) -> Limits;

    /// Creates every object of the live lesson, finding what an interrupted attempt left (names
    /// derive from the live lesson's id). BOOTING is reported already; a missing image is an
    /// error naming it ([R5]).
    async fn create(&self, lesson: &Lesson, report: &Reporter) -> Result<Self::Objects, Error>;

    /// Finds the objects of a live lesson made before (a stage change, an adoption after a
    /// restart), putting back what belongs to them; `None` when they are gone (removed behind
    /// the agent's back, [R9]), and then they are created again. The default creates, which is
    /// right when creating finds what exists.
    async fn locate(
        &self,
        lesson: &Lesson,
        report: &Reporter,
    ) -> Result<Option<Self::Objects>, Error> {
        self.create(lesson, report).await.map(Some)
    }

    /// Where every endpoint is once it runs, one [`Placement`] per endpoint in lesson order;
    /// waits for them to run, within the backend's own bound.
    async fn addresses(
        &self,
        lesson: &Lesson,
        objects: &Self::Objects,
        report: &Reporter,
    ) -> Result<Vec<Placement>, Error>;

    /// Before the stage's configurations: what they need (a configurator, files, the stage's
    /// Jupyter notebook, which the learner reads while the rest goes on). The default does
    /// nothing.
    async fn prepare(&self, _lesson: &Lesson, _objects: &mut Self::Objects) -> Result<(), Error> {
        Ok(())
    }

    /// One try of the stage's configuration of endpoint `index` (in lesson order), bounded by
    /// `timeout`: a run still going then is killed ([`Run::TimedOut`]). An error counts as a
    /// failed try.
    async fn configure(
        &self,
        lesson: &Lesson,
        objects: &Self::Objects,
        index: usize,
        timeout: Duration,
    ) -> Result<Attempt, Error>;

    /// After the stage's configurations, whatever their outcome: what [`Steps::prepare`] made
    /// for them goes. The default does nothing.
    async fn finish(&self, _lesson: &Lesson, _objects: &mut Self::Objects) {}

    /// The generation is READY (its state follows at once): `report` is its reporter, for
    /// news that comes later (an endpoint gone, [R7]). The default does nothing.
    fn ready(&self, _lesson: &Lesson, _report: Reporter) {}

    /// Takes one generation to READY (`Ok`, the endpoints' states) or FAILED (`Err`, the
    /// reason). The default is the SDK's pipeline; only a backend with nothing to realise (the
    /// test agent doing no work) has reason to replace it.
    async fn realise(
        &self,
        lesson: Lesson,
        start: Start,
        report: Reporter,
    ) -> Result<Vec<proto::EndpointState>, String> {
        realise(self, &lesson, start, &report).await
    }
}

/// The pipeline: [`Steps::realise`]'s default.
pub async fn realise<S: Steps + ?Sized>(
    steps: &S,
    lesson: &Lesson,
    start: Start,
    report: &Reporter,
) -> Result<Vec<proto::EndpointState>, String> {
    let limits = steps.limits();
    let mut objects = match start {
        Start::Create => {
            report.phase(Phase::Booting, "creating the live lesson's objects");
            steps.create(lesson, report).await?
        }
        Start::Change | Start::Adopt => match steps.locate(lesson, report).await? {
            Some(objects) => objects,
            None => {
                report.phase(Phase::Booting, "objects gone; creating them again");
                steps.create(lesson, report).await?
            }
        },
    };
    let placements = steps.addresses(lesson, &objects, report).await?;
    let deadline = tokio::time::Instant::now() + limits.probe_timeout;
    let mut states = states(lesson, placements)?;
    report.update(|s| {
        s.phase = Phase::Configuring as i32;
        s.reason = format!("configuring stage {}", lesson.stage);
        s.endpoints = states.clone();
    });
    steps.prepare(lesson, &mut objects).await?;
    let configured = configure(steps, lesson, &objects, &limits).await;
    steps.finish(lesson, &mut objects).await;
    configured?;
    probe_all(lesson, &mut states, deadline, limits.probe_timeout).await?;
    let delay = lesson.ready_delay + limits.extra_ready_delay;
    if !delay.is_zero() {
        report.update(|s| {
            s.reason = format!("reachable; waiting the ready delay of {delay:?}");
            s.endpoints = states.clone();
        });
        tokio::time::sleep(delay).await;
    }
    steps.ready(lesson, report.clone());
    Ok(states)
}

/// The endpoints' states at their placements, none healthy yet; an error names a presentation
/// left without an address.
fn states(
    lesson: &Lesson,
    placements: Vec<Placement>,
) -> Result<Vec<proto::EndpointState>, String> {
    if placements.len() != lesson.endpoints.len() {
        return Err(format!(
            "the backend placed {} endpoints of {}",
            placements.len(),
            lesson.endpoints.len()
        ));
    }
    lesson
        .endpoints
        .iter()
        .zip(placements)
        .map(|(endpoint, mut placement)| {
            let presentations = endpoint
                .presentations
                .iter()
                .map(|p| {
                    let reach = placement.presentations.remove(&p.name).ok_or_else(|| {
                        format!(
                            "endpoint `{}` presentation `{}` (port {}) has no address",
                            endpoint.name, p.name, p.port
                        )
                    })?;
                    let mut state = crate::spec::presentation_state(
                        &p.name,
                        p.kind.wire() as i32,
                        reach.address,
                    );
                    if let Some(url) = reach.url {
                        state.url = url;
                    }
                    Ok(state)
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(proto::EndpointState {
                name: endpoint.name.clone(),
                total: presentations.len() as u32,
                presentations,
                healthy: 0,
                internal_address: placement.internal_address,
            })
        })
        .collect()
}

/// Runs the stage's configuration of every endpoint that has one ([R3]): one after another in
/// lesson order, or all at once; the first failure (in lesson order) is the reason.
async fn configure<S: Steps + ?Sized>(
    steps: &S,
    lesson: &Lesson,
    objects: &S::Objects,
    limits: &Limits,
) -> Result<(), String> {
    let configured = lesson
        .endpoints
        .iter()
        .enumerate()
        .filter(|(_, e)| e.configuration.is_some());
    if limits.configure_at_once {
        let runs = configured
            .map(|(index, endpoint)| tries(steps, lesson, objects, limits, index, endpoint));
        for result in join_all(runs).await {
            result?;
        }
        return Ok(());
    }
    for (index, endpoint) in configured {
        tries(steps, lesson, objects, limits, index, endpoint).await?;
    }
    Ok(())
}

/// Runs every future of `futures` at once; their outputs in order. (The futures crate's
/// `join_all`, which the SDK does without: it is not among its dependencies without features.)
async fn join_all<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut running: Vec<_> = futures.map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = running.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (future, output) in running.iter_mut().zip(outputs.iter_mut()) {
            // A finished future is never polled again.
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(value) => *output = Some(value),
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// One endpoint's configuration, tried up to [`Limits::configuration_tries`] times.
async fn tries<S: Steps + ?Sized>(
    steps: &S,
    lesson: &Lesson,
    objects: &S::Objects,
    limits: &Limits,
    index: usize,
    endpoint: &Endpoint,
) -> Result<(), String> {
    let Some(configuration) = &endpoint.configuration else {
        return Ok(());
    };
    let tries = limits.configuration_tries.max(1);
    let timeout = lesson.configuration_timeout(limits.configuration_timeout);
    let mut last = String::new();
    for attempt in 1..=tries {
        match steps.configure(lesson, objects, index, timeout).await {
            Ok(Attempt::Ran(Run::Exited(0), _)) => return Ok(()),
            Ok(Attempt::Ran(run, output)) => {
                last = crate::output::failed_try(run, &output, timeout);
            }
            Ok(Attempt::Settled(verdict)) => return verdict,
            Err(err) => last = err.to_string(),
        }
        tracing::warn!(live_lesson.id = %lesson.id, endpoint = %endpoint.name, attempt, "configuration failed");
        if attempt < tries {
            tokio::time::sleep(limits.retry_pause).await;
        }
    }
    Err(format!(
        "configuration {} of endpoint `{}` for stage {} failed {tries} times; last: {last}",
        configuration.file_name, endpoint.name, lesson.stage,
    ))
}

/// Probes every presentation at its reported address until it answers ([R1], [R2]), all
/// within `deadline`; counts the healthy ones.
async fn probe_all(
    lesson: &Lesson,
    states: &mut [proto::EndpointState],
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> Result<(), String> {
    for (endpoint, state) in lesson.endpoints.iter().zip(states.iter_mut()) {
        for (declared, reported) in endpoint.presentations.iter().zip(&state.presentations) {
            let expect = declared.kind.expect();
            let address = &reported.address;
            probe::until_ready(address, expect, deadline)
                .await
                .map_err(|last| {
                    format!(
                        "endpoint `{}` presentation `{}` ({expect:?} at {address}) not ready within {timeout:?}: {last}",
                        endpoint.name, declared.name
                    )
                })?;
            state.healthy += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::StateBook;

    /// A backend on loopback: each presentation a real listener (answering HTTP, or silent),
    /// configurations scripted by the number of failed tries before one passes.
    struct Script {
        /// Each endpoint's placement, as `addresses` answers it.
        placements: Vec<Placement>,
        /// Tries of each configuration that fail before one passes (`u32::MAX`: all).
        failing: u32,
        /// The backend tries by itself and answers this verdict.
        settled: Option<Result<(), String>>,
        /// Objects of an earlier generation are gone.
        gone: bool,
        /// Configurations run all at once, each waiting for the others.
        at_once: Option<Arc<tokio::sync::Barrier>>,
        /// What happened, in order, with the phase reported then.
        seen: Mutex<Vec<String>>,
    }

    impl Script {
        fn new(placements: Vec<Placement>) -> Script {
            Script {
                placements,
                failing: 0,
                settled: None,
                gone: false,
                at_once: None,
                seen: Mutex::new(vec![]),
            }
        }

        fn saw(&self, what: &str, report: &Reporter) {
            let phase = report.current().map_or(Phase::Unspecified, |s| s.phase());
            self.seen
                .lock()
                .unwrap()
                .push(format!("{what} {}", phase.as_str_name()));
        }

        fn seen(&self) -> Vec<String> {
            self.seen.lock().unwrap().clone()
        }
    }

    #[tonic::async_trait]
    impl Steps for Script {
        type Objects = Reporter;

        fn limits(&self) -> Limits {
            Limits {
                probe_timeout: Duration::from_millis(600),
                retry_pause: Duration::ZERO,
                configure_at_once: self.at_once.is_some(),
                ..Limits::default()
            }
        }

        async fn create(&self, _: &Lesson, report: &Reporter) -> Result<Reporter, Error> {
            self.saw("create", report);
            Ok(report.clone())
        }

        async fn locate(&self, _: &Lesson, report: &Reporter) -> Result<Option<Reporter>, Error> {
            self.saw("locate", report);
            Ok((!self.gone).then(|| report.clone()))
        }

        async fn addresses(
            &self,
            _: &Lesson,
            _: &Reporter,
            _: &Reporter,
        ) -> Result<Vec<Placement>, Error> {
            Ok(self.placements.clone())
        }

        async fn configure(
            &self,
            _: &Lesson,
            report: &Reporter,
            index: usize,
            _: Duration,
        ) -> Result<Attempt, Error> {
            self.saw(&format!("configure {index}"), report);
            if let Some(barrier) = &self.at_once {
                barrier.wait().await;
            }
            if let Some(verdict) = &self.settled {
                return Ok(Attempt::Settled(verdict.clone()));
            }
            let tries = self
                .seen()
                .iter()
                .filter(|s| s.starts_with("configure"))
                .count() as u32;
            let mut output = Tail::new(64);
            if tries <= self.failing {
                output.push(b"nope");
                return Ok(Attempt::Ran(Run::Exited(1), output));
            }
            Ok(Attempt::Ran(Run::Exited(0), output))
        }

        fn ready(&self, _: &Lesson, report: Reporter) {
            self.saw("ready", &report);
        }
    }

    /// A listener answering every connection with an HTTP status line, or (`silent`) none.
    async fn listener(silent: bool) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 256];
                    let _ = stream.read(&mut buf).await;
                    if !silent {
                        let _ = stream.write_all(b"HTTP/1.0 200 OK\r\n\r\n").await;
                    }
                    let _ = stream.read(&mut buf).await;
                });
            }
        });
        address
    }

    /// A lesson of `endpoints` endpoints `e0`, `e1`, …, each with an HTTP presentation `page`
    /// on port 80 and a shell configuration `eN.sh`.
    fn lesson(endpoints: usize) -> Lesson {
        let spec = proto::LessonSpec {
            live_lesson_id: "3f1e0c9a-6b8d-4a59-9a0e-2d4c5b6a7e81".into(),
            generation: 1,
            stage: 1,
            endpoints: (0..endpoints)
                .map(|i| proto::Endpoint {
                    name: format!("e{i}"),
                    image: Some(proto::Image {
                        slug: "busybox".into(),
                        ..Default::default()
                    }),
                    presentations: vec![proto::Presentation {
                        name: "page".into(),
                        r#type: proto::PresentationType::Http as i32,
                        port: 80,
                    }],
                    configuration: Some(proto::StageConfiguration {
                        r#type: proto::ConfigurationType::Shell as i32,
                        file_name: format!("e{i}.sh"),
                        contents: b"true".to_vec(),
                        driver: String::new(),
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        Lesson::try_from(spec).unwrap()
    }

    async fn placed(silent: bool) -> Placement {
        Placement::new("10.0.0.2").reach("page", listener(silent).await)
    }

    /// Runs the pipeline over `script` from `start`: its answer and the final reported state.
    async fn run(
        script: &Script,
        lesson: &Lesson,
        start: Start,
    ) -> (
        Result<Vec<proto::EndpointState>, String>,
        proto::LiveLessonState,
    ) {
        let book = Arc::new(StateBook::default());
        book.put(crate::spec::initial_state(
            lesson.spec(),
            Phase::Pending,
            "accepted",
        ));
        let report = Reporter::new(book.clone(), lesson.id.clone(), lesson.generation);
        let answer = realise(script, lesson, start, &report).await;
        (answer, book.get(&lesson.id).unwrap())
    }

    #[tokio::test]
    async fn a_new_live_lesson_boots_configures_answers_its_probes_and_is_ready() {
        let script = Script::new(vec![placed(false).await]);
        let lesson = lesson(1);
        let (answer, state) = run(&script, &lesson, Start::Create).await;
        let endpoints = answer.unwrap();
        assert_eq!(
            script.seen(),
            [
                "create PHASE_BOOTING",
                "configure 0 PHASE_CONFIGURING",
                "ready PHASE_CONFIGURING"
            ]
        );
        assert_eq!(state.reason, "configuring stage 1");
        let page = &endpoints[0].presentations[0];
        assert_eq!(page.url, format!("http://{}/", page.address));
        assert_eq!((endpoints[0].healthy, endpoints[0].total), (1, 1));
        assert_eq!(endpoints[0].internal_address, "10.0.0.2");
    }

    #[tokio::test]
    async fn a_stage_change_finds_the_objects_and_creates_them_again_when_they_are_gone() {
        let mut script = Script::new(vec![placed(false).await]);
        let lesson = lesson(1);
        run(&script, &lesson, Start::Change).await.0.unwrap();
        assert_eq!(script.seen()[0], "locate PHASE_PENDING");
        assert_eq!(script.seen().len(), 3, "{:?}", script.seen());
        script.gone = true;
        script.seen.lock().unwrap().clear();
        run(&script, &lesson, Start::Adopt).await.0.unwrap();
        assert_eq!(
            script.seen()[..2],
            ["locate PHASE_PENDING", "create PHASE_BOOTING"]
        );
    }

    #[tokio::test]
    async fn a_configuration_is_tried_three_times_and_the_reason_ends_with_the_last_try() {
        let mut script = Script::new(vec![placed(false).await]);
        script.failing = u32::MAX;
        let (answer, _) = run(&script, &lesson(1), Start::Create).await;
        assert_eq!(
            answer.unwrap_err(),
            "configuration e0.sh of endpoint `e0` for stage 1 failed 3 times; last: exit code 1: nope"
        );
        assert_eq!(
            script
                .seen()
                .iter()
                .filter(|s| s.starts_with("configure"))
                .count(),
            3
        );

        let mut script = Script::new(vec![placed(false).await]);
        script.failing = 2;
        run(&script, &lesson(1), Start::Create).await.0.unwrap();
        assert_eq!(
            script
                .seen()
                .iter()
                .filter(|s| s.starts_with("configure"))
                .count(),
            3
        );
    }

    #[tokio::test]
    async fn a_backend_that_tries_by_itself_is_not_tried_again() {
        let mut script = Script::new(vec![placed(false).await]);
        script.settled = Some(Err("Job e0-g1 failed".into()));
        let (answer, _) = run(&script, &lesson(1), Start::Create).await;
        assert_eq!(answer.unwrap_err(), "Job e0-g1 failed");
        assert_eq!(
            script
                .seen()
                .iter()
                .filter(|s| s.starts_with("configure"))
                .count(),
            1
        );
    }

    #[tokio::test]
    async fn configurations_at_once_run_together() {
        let mut script = Script::new(vec![placed(false).await, placed(false).await]);
        // Each configuration waits for the other: one after another would never end.
        script.at_once = Some(Arc::new(tokio::sync::Barrier::new(2)));
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            run(&script, &lesson(2), Start::Create),
        )
        .await
        .expect("both configurations ran at once");
        assert_eq!(answer.0.unwrap().len(), 2);
    }

    #[tokio::test]
    async fn a_silent_presentation_fails_the_generation_naming_it() {
        let script = Script::new(vec![placed(true).await]);
        let (answer, _) = run(&script, &lesson(1), Start::Create).await;
        let reason = answer.unwrap_err();
        assert!(
            reason.starts_with("endpoint `e0` presentation `page` (Http at 127.0.0.1:")
                && reason.contains("not ready within 600ms"),
            "{reason}"
        );
        assert!(!script.seen().iter().any(|s| s.starts_with("ready")));
    }

    #[tokio::test]
    async fn a_presentation_left_unplaced_is_named() {
        let script = Script::new(vec![Placement::new("")]);
        let (answer, _) = run(&script, &lesson(1), Start::Create).await;
        assert_eq!(
            answer.unwrap_err(),
            "endpoint `e0` presentation `page` (port 80) has no address"
        );
    }

    #[tokio::test]
    async fn the_ready_delay_is_reported_and_waited_after_the_probes() {
        let script = Script::new(vec![placed(false).await]);
        let mut spec = lesson(1).spec().clone();
        spec.ready_delay = Some(prost_types::Duration {
            seconds: 0,
            nanos: 100_000_000,
        });
        let lesson = Lesson::try_from(spec).unwrap();
        let (answer, state) = run(&script, &lesson, Start::Create).await;
        answer.unwrap();
        assert_eq!(state.reason, "reachable; waiting the ready delay of 100ms");
        assert_eq!(
            state.endpoints[0].healthy, 1,
            "reported healthy while waiting"
        );
    }
}
