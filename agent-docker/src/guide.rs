//! Jupyter guides (PROTOCOL.md [V7]): the endpoint the scheduler adds to a lesson with Jupyter
//! stage guides runs from `--jupyter-image` (whatever its image slug says), and every
//! generation writes its stage's notebook to [`NOTEBOOK`] in it by one archive upload, so a
//! stage change swaps the notebook Jupyter serves without restarting it.

use antidote_proto::agent::v1 as proto;
use bollard::Docker;
use bollard::query_parameters::UploadToContainerOptions;

use crate::configurator;
use crate::engine::{self, EngineError};
use crate::settings::Settings;

/// The Jupyter image tests/docker/configurator.sh builds.
pub const DEFAULT_IMAGE: &str = "antidote/jupyter:latest";

/// Where the notebook is written in the guide endpoint; the image's Jupyter serves
/// `/antidote/guide`, so it is `guide.ipynb` at the root of its tree.
pub const NOTEBOOK: &str = "antidote/guide/guide.ipynb";

/// Whether the Jupyter image is on the engine: without it, agent-docker does not offer
/// `guide.jupyter` (checked once, at start).
pub async fn available(docker: &Docker, settings: &Settings) -> bool {
    if settings.jupyter_image.is_empty() {
        return false;
    }
    match docker.inspect_image(&settings.jupyter_image).await {
        Ok(_) => true,
        Err(err) => {
            tracing::warn!(
                image = %settings.jupyter_image,
                error = %err,
                "the jupyter image is not on the engine (build it with tests/docker/configurator.sh jupyter): jupyter guides are not offered"
            );
            false
        }
    }
}

/// Writes every guide endpoint's notebook of `spec` into its container.
pub async fn write(docker: &Docker, spec: &proto::LessonSpec) -> Result<(), EngineError> {
    for endpoint in &spec.endpoints {
        let Some(guide) = &endpoint.jupyter_guide else {
            continue;
        };
        docker
            .upload_to_container(
                &engine::container_name(&spec.live_lesson_id, &endpoint.name),
                Some(UploadToContainerOptions {
                    path: "/".into(),
                    ..Default::default()
                }),
                bollard::body_full(configurator::one_file(NOTEBOOK, &guide.notebook).into()),
            )
            .await?;
    }
    Ok(())
}
