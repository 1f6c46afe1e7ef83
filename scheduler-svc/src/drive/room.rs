//! Making room for a learner: when a learner's live lesson cannot be placed because the agents
//! that fit it are full, a warm-pool member on such an agent gives way. The reconciler calls
//! it while the live lesson waits; the pools never do, so neither needs the other here.

use super::placement::{self, Candidate, Needs};
use crate::error::Error;
use crate::model::{LiveLesson, Millis, Status};
use crate::store::Store;

/// Makes room for `lesson` (a learner's live lesson placement found no agent for) by removing
/// one unclaimed member from an agent that fits it but is full; the member's removal is the
/// caller's to hand to the reconciler. Nothing when the live lesson is itself a member, when
/// a member on such an agent is already being removed (room is coming), or when no full agent
/// that fits holds a member.
pub async fn give_way(
    store: &Store,
    candidates: &[Candidate],
    needs: &Needs,
    lesson: &LiveLesson,
) -> Result<Option<LiveLesson>, Error> {
    if lesson.pool_session.is_some() {
        return Ok(None);
    }
    for candidate in candidates {
        let full = candidate.capacity > 0 && candidate.load >= candidate.capacity;
        let freed = Candidate {
            load: candidate.load.saturating_sub(1),
            ..candidate.clone()
        };
        if !full || placement::choose(&[freed], needs).is_err() {
            continue;
        }
        let mut members = store.pool_members_on(&candidate.name).await?;
        if members.iter().any(|m| m.deleting) {
            return Ok(None);
        }
        // Those not READY first, then the newest.
        members.sort_by_key(|m| (m.status == Status::Ready, std::cmp::Reverse(m.created_at)));
        for member in members {
            let why = format!("gave way to live lesson {}", lesson.id);
            if let Some(removed) = store
                .remove_pool_member(member.id, &why, Millis::now())
                .await?
            {
                tracing::info!(live_lesson.id = %removed.id, agent = %candidate.name, reason = %why, "pools: member gave way");
                return Ok(Some(removed));
            }
        }
    }
    Ok(None)
}
